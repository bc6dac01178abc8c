__version__ = "0.1.0"

# Bumped whenever the engine directory's contract (manifest schema, graph I/O, KV layout) changes.
ENGINE_FORMAT_VERSION = 2
# 1: no sequence graph (its Session runs the batch graph); still loads.
READABLE_FORMAT_VERSIONS = (1, 2)
