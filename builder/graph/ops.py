"""A small ONNX graph writer: nodes, inputs and outputs in memory, weights streamed to one external data file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from camshaft.errors import DISK_FULL, BuildConfigError

ALIGN = 64
ONNX_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
NP_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


# (tensor name, its bytes) → (data file, offset) of an identical tensor another graph already stores, or None
Reuse = Callable[[str, bytes], tuple[str, int] | None]


class GraphWriter:
    """`reuse`: where a weight can point instead of being written again (a second graph sharing the first's data)."""

    def __init__(self, data_file: BinaryIO, data_location: str, reuse: Reuse | None = None) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._data = data_file
        self._location = data_location
        self._reuse = reuse
        self._offset = 0
        self._counter = 0
        self._const_cache: dict[tuple, str] = {}

    def _name(self, hint: str) -> str:
        self._counter += 1
        return f"{hint}_{self._counter}"

    def input(self, name: str, elem_type: int, shape: list[str | int]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, name: str, elem_type: int, shape: list[str | int]) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def weight(self, name: str, array: np.ndarray) -> str:
        """A large tensor, written to the external data file now so memory stays flat. int4 arrays (ml_dtypes) are
        packed two elements a byte, the first in the low nibble, as ONNX stores them."""
        array = np.ascontiguousarray(array)
        if array.dtype == np.float16 and not np.isfinite(array).all():  # the cast from the checkpoint overflowed
            raise BuildConfigError(f"{name} holds values beyond float16's range (or not finite in the checkpoint); "
                                   "build with --dtype bfloat16 (sm80 and later)")
        if array.dtype == ml_dtypes.int4:
            nibbles = array.reshape(-1).view(np.uint8) & 0x0F
            nibbles = np.concatenate([nibbles, np.zeros(nibbles.size % 2, np.uint8)])
            raw = (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()
        else:
            raw = array.tobytes()
        found = self._reuse(name, raw) if self._reuse is not None else None
        if found is None:
            pad = (-self._offset) % ALIGN
            self._data.write(b"\0" * pad)
            self._offset += pad
            found = self._location, self._offset
            self._data.write(raw)
            self._offset += len(raw)
        tensor = onnx.TensorProto()
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        tensor.dims.extend(array.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", found[0]), ("offset", str(found[1])), ("length", str(len(raw)))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.initializers.append(tensor)
        return name

    def const(self, array: np.ndarray, hint: str = "const") -> str:
        """A small constant kept inside the graph; identical constants are shared."""
        array = np.asarray(array)
        key = (array.dtype.str, array.shape, array.tobytes()) if array.size <= 64 else None
        if key is not None and key in self._const_cache:
            return self._const_cache[key]
        name = self._name(hint)
        self.initializers.append(numpy_helper.from_array(array, name))
        if key is not None:
            self._const_cache[key] = name
        return name

    def ints(self, values: list[int]) -> str:
        return self.const(np.array(values, dtype=np.int64), "shape")

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, name: str | None = None,
           domain: str = "", omit: tuple[int, ...] = (), **attrs) -> str | list[str]:
        """`omit`: optional outputs left unnamed, so the kernel need not compute them ("" in the list returned)."""
        node_name = name or self._name(op_type)
        outputs = ["" if i in omit else f"{node_name}/out{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=node_name, domain=domain, **attrs))
        return outputs[0] if n_out == 1 else outputs

    def branch(self, cond: str, lower: Callable[[], str], otherwise: str, elem_type: int) -> str:
        """An If on `cond`: the nodes `lower` writes run only when it holds; else the value `otherwise`."""
        return self.branches(cond, lower, lambda: self.op("Identity", [otherwise]), elem_type)

    def branches(self, cond: str, lower: Callable[[], str], otherwise: Callable[[], str], elem_type: int) -> str:
        """An If on `cond`: the nodes `lower` writes run when it holds, those `otherwise` writes when not."""
        then, other = (self._subgraph(write, name, elem_type) for write, name in ((lower, "then"), (otherwise, "else")))
        return self.op("If", [cond], then_branch=then, else_branch=other)

    def _subgraph(self, write: Callable[[], str], name: str, elem_type: int) -> onnx.GraphProto:
        outer, self.nodes = self.nodes, []
        try:
            out = write()
        finally:
            inner, self.nodes = self.nodes, outer
        return helper.make_graph(inner, self._name(name), [], [helper.make_tensor_value_info(out, elem_type, None)])

    def op_to(self, op_type: str, inputs: list[str], output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=self._name(op_type), **attrs))
        return output

    def model(self, opset: int, name: str = "camshaft") -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="camshaft")
        model.ir_version = 10
        return model


def save_model(model: onnx.ModelProto, path: Path) -> None:
    """Save a graph whose initializers already live in external data (the proto itself stays small)."""
    with open(path, "wb") as f:
        f.write(model.SerializeToString())


@contextmanager
def weights_file(path: Path) -> Iterator[BinaryIO]:
    """The external data file a GraphWriter writes into; a full disk, met by a write or by the close that flushes
    the last ones, is said with its path."""
    try:
        with open(path, "wb") as data:
            yield data
    except OSError as exc:
        if exc.filename is not None or exc.errno not in DISK_FULL:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
