"""Flower's floor: the cheapest app with the same message sizes as feddifrc-app."""
