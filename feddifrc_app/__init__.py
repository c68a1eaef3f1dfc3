"""FedDifRC (ICCV 2025) as a Flower app."""

import logging

# A child of Flower's logger, so every line reaches `flwr run --stream` and `flwr log`.
log = logging.getLogger("flwr.feddifrc")
