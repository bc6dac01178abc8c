"""The sequence graph loaded for running one sequence at a time (Session); batch_sequence.py puts the batch graph
behind the same calls.

Both give the Session `start(total)` → `feed(tokens, start)` (logits of the last token fed) → `finish()`. The
sequence graph's cache is contiguous per layer, [1, kv_heads, L, head_dim]; it grows (in steps of GROW tokens, up
to max_seq_len) when a request needs more and is kept for the next one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from camshaft.engine_files import unchanged_while_loading
from camshaft.errors import CapacityError, EngineError
from camshaft.graph_meta import sequence_graph_support
from camshaft.io_signature import SEQUENCE_INPUTS
from camshaft.manifest import Manifest, read_manifest
from camshaft.runtime.backends.huge_pages import release_freed_memory
from camshaft.runtime.backends.onnxruntime import (
    GraphIO,
    check_compatible,
    check_signature,
    load_session,
    session_options,
)
from camshaft.runtime.engine import check_model_inputs, end_ids, load_tokenizer
from camshaft.runtime.kv_cache import fraction_bytes, host_available
from camshaft.runtime.prompt_lookup import MAX_DRAFT

GROW = 256
MAX_ROWS = MAX_DRAFT + 1  # logits rows one feed may ask for: a token and its drafts


def over_budget(total: int, holds: int, how: str) -> CapacityError:
    return CapacityError(f"the request needs {total} tokens of KV cache; the budget holds {holds} ({how}): raise "
                         "kv_cache_memory or lower max_tokens")


class SequenceEngine:
    """`kv_cache_memory` (bytes, or a fraction of the memory available once the weights are loaded) bounds the cache:
    a sequence that would need more is refused at `start`."""

    def __init__(self, engine_dir: str | Path, *, threads: int | None = None, manifest: Manifest | None = None,
                 kv_cache_memory: int | float | None = None, huge_pages: bool = True):
        self.dir = Path(engine_dir)
        self.manifest = m = manifest or read_manifest(self.dir)
        if m.sequence_graph is None:
            kv_dtype = m.kv_cache.dtype if m.kv_cache.dtype in ("int8", "float8") else None
            reason = sequence_graph_support(m.model, m.dtype, kv_dtype) if m.target == "onnxruntime" else None
            raise EngineError(f"{self.dir} has no sequence graph ({reason}); run its batch graph: "
                              "Session(engine_dir, graph=\"batch\")" if reason else
                              f"{self.dir} has no sequence graph; rebuild it with this camshaft for --target "
                              "onnxruntime, or run its batch graph: Session(engine_dir, graph=\"batch\")")
        if m.target != "onnxruntime":
            raise EngineError(f"{self.dir}: its manifest says target {m.target!r}, but sequence graphs are the "
                              "onnxruntime target's: the manifest was edited or belongs to another build; rebuild "
                              "the engine")
        check_compatible(m)
        check_model_inputs(m, self.dir)
        self.layout = m.sequence_graph
        unknown = {spec.name for spec in self.layout.inputs} - {spec.name for spec in SEQUENCE_INPUTS}
        if unknown:
            raise EngineError(f"{self.dir}: the sequence graph takes inputs this camshaft does not produce "
                              f"({', '.join(sorted(unknown))}); upgrade camshaft or rebuild the engine with this one")
        with unchanged_while_loading(self.dir, m.build_id):
            self.session, self.huge_page_bytes = load_session(self.dir / self.layout.artifact,
                                                              session_options(threads, spin_wait=True), huge_pages)
            check_signature(GraphIO.of_session(self.session), self.dir, m, self.layout)
            # its weights are the batch graph's, read by offset: that graph must be of the same build (and as its
            # manifest says: one verdict with the batch graph's loaders and inspect)
            check_signature(GraphIO.of_file(self.dir / m.artifact), self.dir, m, m.kv_cache)
            self.binding = self.session.io_binding()
            self.tokenizer = load_tokenizer(self.dir, m.files)
        self.eos_token_ids = end_ids(m.model, self.tokenizer)
        self.caches: list[np.ndarray] = []
        # Bound once: a decode step writes its token and lengths into these and rebinds nothing.
        self._token = np.zeros((1, 1), dtype=np.int64)
        self._seqlens = np.zeros(1, dtype=np.int32)
        self._total = np.zeros((), dtype=np.int32)
        self._values = [ort.OrtValue.ortvalue_from_numpy(a) for a in (self._token, self._seqlens, self._total)]
        self._token_bound = False
        self.binding.bind_ortvalue_input("seqlens_k", self._values[1])
        self.binding.bind_ortvalue_input("total_sequence_length", self._values[2])
        # logits rows: 1, or a token and its drafts (prompt lookup) on engines whose graph takes num_logits
        self.max_rows = MAX_ROWS if self.layout.checks_drafts else 1
        self._rows_wanted = np.ones(1, dtype=np.int64)
        if self.max_rows > 1:
            self._values.append(ort.OrtValue.ortvalue_from_numpy(self._rows_wanted))
            self.binding.bind_ortvalue_input("num_logits", self._values[-1])
        self._greedy = np.zeros((), dtype=np.bool_)  # a float head's certified greedy shortcut (screen.py), per step
        if self.layout.screens_greedy:
            self._values.append(ort.OrtValue.ortvalue_from_numpy(self._greedy))
            self.binding.bind_ortvalue_input("greedy", self._values[-1])
        self._long_rope_from = np.zeros(1, dtype=np.int64)
        if any(spec.name == "long_rope_from" for spec in self.layout.inputs):  # as the model says: check_model_inputs
            self._values.append(ort.OrtValue.ortvalue_from_numpy(self._long_rope_from))
            self.binding.bind_ortvalue_input("long_rope_from", self._values[-1])
        self._all_logits = np.empty((self.max_rows, m.model.vocab_size), dtype=np.float32)
        self._bind_logits(1)
        self._length = 0
        self.token_budget = self.limits.max_seq_len  # tokens (prompt + output) one sequence may hold
        self.token_bytes = self.layout.bytes_per_token(np.dtype(np.float32).itemsize)
        fraction = kv_cache_memory if isinstance(kv_cache_memory, float) else None
        if fraction is not None:
            kv_cache_memory = fraction_bytes(fraction, host_available())
        if kv_cache_memory is not None:
            self.token_budget = min(self.token_budget, kv_cache_memory // self.token_bytes)
            if self.token_budget < 1:
                given = f" ({fraction} of the memory available)" if fraction is not None else ""
                raise CapacityError(f"a KV cache budget of {kv_cache_memory} bytes{given} holds no token "
                                    f"({self.token_bytes} bytes each); raise the budget")

    @property
    def limits(self):
        return self.manifest.limits

    @property
    def capacity(self) -> int:
        """Tokens the bound cache holds."""
        return self.caches[0].shape[2] if self.caches else 0

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def check_fits(self, total: int) -> None:
        """Refuse a sequence of `total` tokens (prompt + max_tokens) the KV budget cannot hold (CapacityError)."""
        if total > self.token_budget:
            raise over_budget(total, self.token_budget, f"{self.token_bytes} bytes a token")

    def start(self, total: int, longest_pass: int | None = None) -> None:
        """Make room for a sequence of `total` tokens (prompt + max_tokens) fed at most `longest_pass` of them (None:
        all), which picks LongRoPE's factors."""
        self.check_fits(total)
        if total > self.capacity:
            self._bind_caches(min(-(-total // GROW) * GROW, self.token_budget))
        self._length = 0
        self._long_rope_from[0] = self.manifest.model.rope.long_rope_from(longest_pass or total)

    def _bind_caches(self, length: int) -> None:
        layout = self.layout
        self.caches = []
        names = zip(layout.key_inputs + layout.value_inputs, layout.key_outputs + layout.value_outputs, strict=True)
        for input_name, output_name in names:
            cache = np.zeros((1, layout.num_kv_heads, length, layout.head_dim), dtype=np.float32)
            value = ort.OrtValue.ortvalue_from_numpy(cache)
            self.binding.bind_ortvalue_input(input_name, value)
            self.binding.bind_ortvalue_output(output_name, value)
            self.caches.append(cache)

    def feed(self, tokens: list[int], start: int, copy: bool = True, last: bool = True) -> np.ndarray:
        """Logits [vocab] after `tokens`, which continue the sequence from position `start`. With `copy` False, a
        view of the bound output buffer, valid until the next feed. (`last`: unused; this graph always returns the
        last token's logits.)"""
        if start != self._length:
            raise EngineError(f"the sequence holds {self._length} tokens; cannot continue it at {start}")
        rows = self.feed_rows(tokens, start, 1)[0]
        return rows.copy() if copy else rows

    def feed_rows(self, tokens: list[int], start: int, rows: int) -> np.ndarray:
        """Logits [rows, vocab] of the last `rows` tokens fed (a view of the bound buffer, valid until the next
        feed). `start` may be before the end of what was fed: the cache from there on is written again (drafted
        tokens that were not accepted)."""
        if start > self._length:
            raise EngineError(f"the sequence holds {self._length} tokens; cannot continue it at {start}")
        if start + len(tokens) > self.capacity:
            raise EngineError(f"{start + len(tokens)} tokens exceed the {self.capacity} this sequence was started for; "
                              "call start() with its whole length first")
        if not 1 <= rows <= min(len(tokens), self.max_rows):
            raise EngineError(f"{rows} rows of logits asked for {len(tokens)} tokens; this engine's sequence graph "
                              f"gives 1 to {self.max_rows}" + ("" if self.max_rows > 1 else
                                                              " (rebuild it with this camshaft for more)"))
        if rows != self.logits.shape[0]:
            self._bind_logits(rows)
        self.prepare(tokens, start)
        self.session.run_with_iobinding(self.binding)
        self._length = start + len(tokens)
        return self.logits

    def _bind_logits(self, rows: int) -> None:
        self.logits = self._all_logits[:rows]
        self._rows_wanted[0] = rows
        self.binding.bind_output("logits", "cpu", 0, np.float32, self.logits.shape, self.logits.ctypes.data)

    def prepare(self, tokens: list[int], start: int) -> None:
        """Bind a step's inputs (a decode step writes into the bound buffers)."""
        total = start + len(tokens)
        if len(tokens) == 1:
            self._token[0, 0] = tokens[0]
            if not self._token_bound:
                self.binding.bind_ortvalue_input("input_ids", self._values[0])
                self._token_bound = True
        else:
            self.binding.bind_cpu_input("input_ids", np.asarray([tokens], dtype=np.int64))
            self._token_bound = False
        self._seqlens[0] = total - 1
        self._total[()] = total

    def screen(self, greedy: bool) -> None:
        """Whether the next steps' logits only need their argmax (plain greedy, nothing transforming the logits): a
        float head then gives the best rows' logits and −inf elsewhere (builder/graph/screen.py), the same argmax."""
        self._greedy[()] = greedy

    def finish(self) -> None:
        self._length = 0

    def close(self) -> None:
        self.binding = self.session = None
        self.caches = []
        release_freed_memory()
