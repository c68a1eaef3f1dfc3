"""FedDifRC: the diffusion teacher's targets (TDCL + NDCR) and the federated basis."""
