"""Copied into each model of a camshaft Triton repository as 1/model.py: loads the class named by the config
parameter `camshaft_model` ("module:Class") from the installed camshaft, so the repository follows upgrades (where
none is installed, from `camshaft_path`, where deploy found it; an installed one elsewhere is said in the log)."""

import importlib
import json
import os
import sys


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        try:
            import camshaft
        except ImportError:  # the stub's Python does not see camshaft: use where deploy found it
            sys.path.insert(0, params["camshaft_path"])
        else:
            found = os.path.dirname(os.path.dirname(os.path.realpath(camshaft.__file__)))
            if found != os.path.realpath(params["camshaft_path"]):  # e.g. deployed from a checkout on PYTHONPATH
                print(f"camshaft: warning: this model runs the camshaft installed in {found}, not the one in "
                      f"{params['camshaft_path']} that deployed it; install that one, or deploy with this one",
                      file=sys.stderr, flush=True)
        module, _, name = params["camshaft_model"].partition(":")
        self.impl = getattr(importlib.import_module(module), name)(args, params)

    def execute(self, requests):
        return self.impl.execute(requests)

    def finalize(self):
        self.impl.finalize()
