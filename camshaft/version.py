__version__ = "0.1.0"

# Bumped whenever the engine directory's contract (manifest schema, graph I/O, KV layout) changes.
ENGINE_FORMAT_VERSION = 4
# 1: no sequence graph (its Session runs the batch graph); 2: no build_id or file fingerprints (tokenizer files not
# listed); 3: no manifest digest; all still load.
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4)
