"""camshaft: build, quantize, serve and benchmark LLM inference engines."""

from camshaft.version import __version__

__all__ = ["__version__", "LLM", "Session", "SamplingParams"]


def __getattr__(name: str):
    # Lazy so that `import camshaft` (and the CLI's --help) stays fast.
    if name == "Session":
        from camshaft.runtime.session import Session

        return Session
    if name == "SamplingParams":
        from camshaft.runtime.sampling_params import SamplingParams

        return SamplingParams
    if name == "LLM":
        from camshaft.runtime.llm import LLM

        return LLM
    raise AttributeError(name)
