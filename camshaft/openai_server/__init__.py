"""An OpenAI-compatible HTTP server over the in-flight batching executor."""
