"""The data: dataset sources, node shares and hold-outs, transforms and the loader."""
