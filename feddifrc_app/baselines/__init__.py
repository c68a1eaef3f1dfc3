"""The comparison methods of the FedDifRC paper that Flower does not ship: SCAFFOLD, FedNova, MOON, FedNH."""
