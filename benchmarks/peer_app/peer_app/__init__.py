"""A plain Flower app doing the work of feddifrc-app's FedAvg round (benchmarks/peer_ratio.py)."""
