"""Copied into each model of a camshaft Triton repository as 1/model.py: loads the class named by the config
parameter `camshaft_model` ("module:Class") from the installed camshaft, so the repository follows upgrades."""

import importlib
import json
import sys


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        try:
            import camshaft  # noqa: F401
        except ImportError:  # the stub's Python does not see camshaft: use where deploy found it
            sys.path.insert(0, params["camshaft_path"])
        module, _, name = params["camshaft_model"].partition(":")
        self.impl = getattr(importlib.import_module(module), name)(args, params)

    def execute(self, requests):
        return self.impl.execute(requests)

    def finalize(self):
        self.impl.finalize()
