"""Triton Inference Server deployment: a generated model repository hosting camshaft's executor, and the
bundled tritonserver."""
