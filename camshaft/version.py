__version__ = "0.1.0"

# Bumped whenever the engine directory's contract (manifest schema, graph I/O, KV layout) changes.
ENGINE_FORMAT_VERSION = 1
