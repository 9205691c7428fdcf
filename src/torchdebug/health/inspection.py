"""Model inspection: ``inspect_model`` / ``ModelSummary`` (per-module table, totals, input validation)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..events import module_label, plain

_MiB = 1024 * 1024


# --------------------------------------------------------------------------- forward tracing helpers


def call_model(model: nn.Module, example_input: Any) -> Any:
    """Call ``model`` with an example: a tensor is one argument, a tuple/list positional args, a dict kwargs."""
    if isinstance(example_input, Mapping):
        return model(**example_input)
    if isinstance(example_input, (tuple, list)):
        return model(*example_input)
    return model(example_input)


@contextlib.contextmanager
def traced_forward(
    model: nn.Module,
    pre_hook: Callable[[nn.Module, tuple[Any, ...]], None] | None = None,
    hook: Callable[[nn.Module, tuple[Any, ...], Any], None] | None = None,
) -> Iterator[None]:
    """Run the body in eval mode under ``no_grad`` with hooks on every module; undo everything on exit.

    Eval mode keeps BatchNorm running statistics and dropout untouched; the training flag of every
    module is restored one by one (a model may mix train and eval submodules), also on exceptions.
    """
    modes = [(m, m.training) for m in model.modules()]
    handles = []
    try:
        for m in model.modules():
            if pre_hook is not None:
                handles.append(m.register_forward_pre_hook(pre_hook))
            if hook is not None:
                handles.append(m.register_forward_hook(hook))
        model.eval()
        with torch.no_grad():
            yield
    finally:
        for h in handles:
            h.remove()
        for m, was_training in modes:
            m.training = was_training


def _first_param(model: nn.Module) -> torch.Tensor | None:
    return next(iter(model.parameters()), None)


def _is_leaf(m: nn.Module) -> bool:
    return next(iter(m.children()), None) is None


def _has_own_params(m: nn.Module) -> bool:
    return next(iter(m.parameters(recurse=False)), None) is not None


# --------------------------------------------------------------------------- input validation

_CONV_DIMS: tuple[tuple[type[nn.Module], int], ...] = (
    (nn.Conv1d, 1),
    (nn.Conv2d, 2),
    (nn.Conv3d, 3),
    (nn.ConvTranspose1d, 1),
    (nn.ConvTranspose2d, 2),
    (nn.ConvTranspose3d, 3),
)


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def validate_layer_input(layer: nn.Module, x: Any, name: str = "") -> list[str]:
    """Problems, in plain words, with feeding ``x`` to ``layer`` (empty when it looks fine).

    Checks Linear (last dim vs ``in_features``), Conv/ConvTranspose (rank and ``in_channels``),
    Embedding/EmbeddingBag (integer dtype, indices in ``[0, num_embeddings)``), RNN/LSTM/GRU
    (``input_size``), BatchNorm/GroupNorm/LayerNorm (feature dims), and for every layer with a
    weight: floating dtype and device matching the weight. Cost: Embedding index bounds need one
    host transfer (``aminmax``); everything else reads metadata only.
    """
    label = module_label(name, type(layer).__name__)
    if not isinstance(x, torch.Tensor):
        return [f"{label} received a {type(x).__name__}, not a tensor"]
    problems: list[str] = []
    weight = next(iter(layer.parameters(recurse=False)), None)
    shp = _shape(x)

    if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            problems.append(
                f"{label} needs integer indices but the input has dtype {x.dtype}; pass a LongTensor (x.long())"
            )
        elif x.numel() > 0:
            lo, hi = (int(v) for v in torch.aminmax(x))  # one host transfer, on-demand check
            if lo < 0 or hi >= layer.num_embeddings:
                problems.append(
                    f"{label} has num_embeddings={layer.num_embeddings} but the input indices range over "
                    f"[{lo}, {hi}]; every index must be in [0, {layer.num_embeddings - 1}]"
                )
    elif weight is not None and weight.is_floating_point() and not (x.is_floating_point() or x.is_complex()):
        problems.append(
            f"{label} needs a floating-point input but got dtype {x.dtype}; convert it (x.float())"
        )
    elif weight is not None and x.is_floating_point() and x.dtype != weight.dtype:
        problems.append(
            f"{label} has {weight.dtype} weights but the input is {x.dtype}; "
            f"convert one of them (x.to({weight.dtype}) or model.to({x.dtype}))"
        )

    if weight is not None and x.device != weight.device:
        problems.append(
            f"{label} has its weights on {weight.device} but the input is on {x.device}; "
            f"move the input (x.to('{weight.device}'))"
        )

    if isinstance(layer, nn.Linear) and (x.dim() == 0 or shp[-1] != layer.in_features):
        problems.append(
            f"{label} expects the last dimension to be in_features={layer.in_features} "
            f"but the input has shape {shp}"
        )
    for conv_type, nd in _CONV_DIMS:
        if isinstance(layer, conv_type):
            conv: Any = layer
            if x.dim() not in (nd + 1, nd + 2):
                problems.append(
                    f"{label} expects a {nd + 2}-D input (N, C, ...) or {nd + 1}-D unbatched, got shape {shp}"
                )
            else:
                c = shp[0] if x.dim() == nd + 1 else shp[1]
                if c != conv.in_channels:
                    problems.append(
                        f"{label} expects in_channels={conv.in_channels} in the channel dimension "
                        f"but the input has shape {shp} ({c} channels)"
                    )
            break
    if isinstance(layer, nn.RNNBase) and (x.dim() == 0 or shp[-1] != layer.input_size):
        problems.append(
            f"{label} expects the last dimension to be input_size={layer.input_size} but the input has shape {shp}"
        )
    if isinstance(layer, nn.modules.batchnorm._BatchNorm) and (x.dim() < 2 or shp[1] != layer.num_features):
        problems.append(
            f"{label} expects num_features={layer.num_features} in dimension 1 but the input has shape {shp}"
        )
    if isinstance(layer, nn.GroupNorm) and (x.dim() < 2 or shp[1] != layer.num_channels):
        problems.append(
            f"{label} expects num_channels={layer.num_channels} in dimension 1 but the input has shape {shp}"
        )
    if isinstance(layer, nn.LayerNorm):
        ns = list(layer.normalized_shape)
        if shp[len(shp) - len(ns) :] != ns or x.dim() < len(ns):
            problems.append(f"{label} normalizes over trailing dims {ns} but the input has shape {shp}")
    return problems


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors_in(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _tensors_in(v)]
    return []


def _shape_of(out: Any) -> Any:
    """JSON-ready shape of a module output: [dims] for a tensor, nested lists/dicts, else the type name."""
    if isinstance(out, torch.Tensor):
        return list(out.shape)
    if isinstance(out, Mapping):
        return {str(k): _shape_of(v) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return [_shape_of(v) for v in out]
    if out is None:
        return None
    return type(out).__name__


def _shape_text(shape: Any) -> str:
    if shape is None:
        return "--"
    if isinstance(shape, list) and all(isinstance(d, int) for d in shape):
        return "[" + ", ".join(str(d) for d in shape) + "]"
    if isinstance(shape, list):
        return "(" + ", ".join(_shape_text(s) for s in shape) + ")"
    if isinstance(shape, dict):
        return "{" + ", ".join(f"{k}: {_shape_text(v)}" for k, v in shape.items()) + "}"
    return str(shape)


class _InputProblem(Exception):
    """Raised from a pre-hook to stop a forward before a bad input reaches a kernel (CUDA asserts are fatal)."""


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class ModuleInfo:
    """One row of a :class:`ModelSummary`.

    ``params``/``trainable``/``bytes`` count the module's whole subtree (a shared parameter once);
    ``bytes`` is parameters plus buffers. ``dtype``/``device`` are those of its parameters
    (``"mixed"`` when they differ, None without parameters). ``output_shape`` is that of its first
    call in the example forward (None when not run), ``calls`` how often it was called.
    """

    name: str
    type: str
    depth: int
    params: int
    trainable: int
    own_params: int
    bytes: int
    dtype: str | None
    device: str | None
    is_leaf: bool
    output_shape: Any = None
    calls: int = 0

    @property
    def label(self) -> str:
        return module_label(self.name, self.type)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class ModelSummary:
    """What :func:`inspect_model` returns: per-module rows (as in ``named_modules``), totals, problems."""

    model_type: str
    modules: tuple[ModuleInfo, ...]
    total_params: int
    trainable_params: int
    param_bytes: int
    buffer_bytes: int
    input_shape: Any = None
    output_shape: Any = None
    problems: tuple[str, ...] = ()
    forward_error: str | None = None

    @property
    def non_trainable_params(self) -> int:
        return self.total_params - self.trainable_params

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.buffer_bytes

    @property
    def ok(self) -> bool:
        """True when the example input (if any) raised no problem."""
        return not self.problems

    def __getitem__(self, name: str) -> ModuleInfo:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"no module named {name!r}; names are as in model.named_modules()")

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        d["non_trainable_params"] = self.non_trainable_params
        d["total_bytes"] = self.total_bytes
        return d

    def __str__(self) -> str:
        children: dict[str, list[ModuleInfo]] = {}
        for m in self.modules[1:]:
            parent = m.name.rpartition(".")[0]
            children.setdefault(parent, []).append(m)
        rows: list[tuple[str, ModuleInfo]] = []

        def walk(m: ModuleInfo, prefix: str, last: bool, root: bool) -> None:
            text = (
                m.type if root else f"{prefix}{'└─' if last else '├─'}{m.name.rpartition('.')[2]} ({m.type})"
            )
            rows.append((text, m))
            kids = children.get(m.name, [])
            child_prefix = "" if root else prefix + ("  " if last else "│ ")
            for i, k in enumerate(kids):
                walk(k, child_prefix, i == len(kids) - 1, False)

        if self.modules:
            walk(self.modules[0], "", True, True)
        header = ("Layer (type)", "Output Shape", "Params", "Trainable", "Bytes", "dtype", "device")
        table = [header]
        for text, m in rows:
            table.append(
                (
                    text,
                    _shape_text(m.output_shape),
                    f"{m.params:,}",
                    f"{m.trainable:,}",
                    _human_bytes(m.bytes),
                    m.dtype or "--",
                    m.device or "--",
                )
            )
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        right = {2, 3, 4}

        def fmt(r: Sequence[str]) -> str:
            cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
            return "  ".join(cells).rstrip()

        rule = "=" * len(fmt(header))
        lines = [rule, fmt(header), rule, *(fmt(r) for r in table[1:]), rule]
        lines.append(f"Total params: {self.total_params:,}")
        lines.append(f"Trainable params: {self.trainable_params:,}")
        lines.append(f"Non-trainable params: {self.non_trainable_params:,}")
        lines.append(f"Params size (MiB): {self.param_bytes / _MiB:.2f}")
        lines.append(f"Buffers size (MiB): {self.buffer_bytes / _MiB:.2f}")
        if self.input_shape is not None:
            lines.append(f"Input shape: {_shape_text(self.input_shape)}")
        if self.output_shape is not None:
            lines.append(f"Output shape: {_shape_text(self.output_shape)}")
        lines.append(rule)
        if self.problems:
            lines.append("Problems:")
            lines.extend(f"  - {p}" for p in self.problems)
        return "\n".join(lines)


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024.0
        if size < 1024:
            return f"{size:.1f} {unit}"
    return f"{size / 1024.0:.1f} TiB"


def _subtree_counts(m: nn.Module) -> tuple[int, int, int, str | None, str | None]:
    params = list(m.parameters())  # deduplicated by identity already
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    nbytes += sum(b.numel() * b.element_size() for b in m.buffers())
    dtypes = {str(p.dtype).replace("torch.", "") for p in params}
    devices = {str(p.device) for p in params}
    dtype = None if not dtypes else (dtypes.pop() if len(dtypes) == 1 else "mixed")
    device = None if not devices else (devices.pop() if len(devices) == 1 else "mixed")
    return total, trainable, nbytes, dtype, device


def example_from_shape(model: nn.Module, input_shape: Sequence[int]) -> torch.Tensor:
    """A seeded example input of ``input_shape`` for ``model``.

    Integer zeros when the first parametrized layer (registration order) is an Embedding(Bag),
    otherwise standard-normal values (seed 0) of the model's parameter dtype, on its device.
    """
    if not isinstance(input_shape, (tuple, list, torch.Size)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in input_shape
    ):
        raise TypeError(
            f"input_shape must be a sequence of non-negative ints like (32, 10), got {input_shape!r}"
        )
    p = _first_param(model)
    device = p.device if p is not None else torch.device("cpu")
    first = next((m for m in model.modules() if _is_leaf(m) and _has_own_params(m)), None)
    if isinstance(first, (nn.Embedding, nn.EmbeddingBag)):
        return torch.zeros(tuple(input_shape), dtype=torch.long, device=device)
    dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
    gen = torch.Generator().manual_seed(0)
    return torch.randn(tuple(input_shape), generator=gen, dtype=dtype).to(device)


def inspect_model(
    model: nn.Module,
    example_input: Any = None,
    *,
    input_shape: Sequence[int] | None = None,
) -> ModelSummary:
    """Per-module summary of ``model`` like torchinfo, with input validation when an example is given.

    Args:
        model: any ``nn.Module``.
        example_input: optional input: a tensor (one argument), a tuple/list (positional args) or a
            dict (keyword args). With it, one forward runs in eval mode under ``no_grad`` with hooks
            that record each module's output shape; the hooks are removed and every module's
            train/eval flag restored afterwards, also when the forward raises.
        input_shape: alternative to ``example_input``: build a seeded example of this shape (see
            :func:`example_from_shape`).

    Returns:
        A :class:`ModelSummary`: ``str()`` is the table, ``.to_dict()`` JSON-ready. With an example,
        ``problems`` lists in plain words what does not fit the first layer that receives it
        (shape, dtype, device, embedding index range) and the error of a failed forward.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``input_shape`` is not a sequence of ints.
        ValueError: both ``example_input`` and ``input_shape`` are given.

    Example:
        >>> net = nn.Sequential(nn.Linear(10, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> s = inspect_model(net, torch.randn(3, 10))
        >>> s["0"].output_shape, s.total_params
        ([3, 4], 54)

    Cost: one forward of the example (no autograd graph); without an example only metadata is read.

    Known limitations: the input check covers the layer types listed in
    :func:`validate_layer_input` and the first argument of the first leaf module with parameters
    that the forward calls; work done with ``torch.nn.functional`` or raw parameters inside a
    parent's ``forward`` has no row of its own; a module called several times shows its first
    output shape (``calls`` says how many).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"inspect_model needs an nn.Module, got {type(model).__name__}")
    if example_input is not None and input_shape is not None:
        raise ValueError("pass either example_input or input_shape, not both")
    if input_shape is not None:
        example_input = example_from_shape(model, input_shape)

    names = {m: n for n, m in model.named_modules()}
    out_shapes: dict[str, Any] = {}
    calls: dict[str, int] = {}
    problems: list[str] = []
    forward_error: str | None = None
    output_shape: Any = None
    model_output_shape: Any = None

    if example_input is not None:
        p = _first_param(model)
        if p is not None:
            for t in _tensors_in(example_input):
                if t.device != p.device:
                    problems.append(
                        f"the input is on {t.device} but the model's parameters are on {p.device}; "
                        f"move one of them (x.to('{p.device}') or model.to('{t.device}'))"
                    )
                    break
        checked = False
        running: list[str] = []  # modules whose forward has started and not ended (innermost last)

        def pre(mod: nn.Module, args: tuple[Any, ...]) -> None:
            nonlocal checked
            name = names.get(mod, "")
            running.append(name)
            if not checked and _is_leaf(mod) and _has_own_params(mod):
                checked = True
                found = validate_layer_input(mod, args[0] if args else None, name)
                if found:
                    problems.extend(found)
                    raise _InputProblem  # stop before the kernel sees the bad input

        def post(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            name = names.get(mod, "")
            if running and running[-1] == name:
                running.pop()
            calls[name] = calls.get(name, 0) + 1
            if name not in out_shapes:
                out_shapes[name] = _shape_of(out)

        with traced_forward(model, pre, post):
            try:
                out = call_model(model, example_input)
                model_output_shape = _shape_of(out)
            except _InputProblem:
                forward_error = "stopped before the first layer: its input does not fit (see problems)"
            except Exception as e:  # the model's own failure is what we are diagnosing: report it
                where = running[-1] if running else None
                label = (
                    module_label(where, type(model.get_submodule(where)).__name__)
                    if where is not None
                    else "?"
                )
                forward_error = f"{type(e).__name__} in {label}: {e}"
                if not checked:
                    first = next((m for m in model.modules() if _is_leaf(m) and _has_own_params(m)), None)
                    if first is not None and isinstance(example_input, torch.Tensor):
                        problems.extend(validate_layer_input(first, example_input, names[first]))
                problems.append(f"the forward failed: {forward_error}")
        output_shape = model_output_shape
        input_shape_rec = _shape_of(example_input)
    else:
        input_shape_rec = None

    rows = []
    for name, m in model.named_modules():
        total, trainable, nbytes, dtype, device = _subtree_counts(m)
        rows.append(
            ModuleInfo(
                name=name,
                type=type(m).__name__,
                depth=0 if name == "" else name.count(".") + 1,
                params=total,
                trainable=trainable,
                own_params=sum(p.numel() for p in m.parameters(recurse=False)),
                bytes=nbytes,
                dtype=dtype,
                device=device,
                is_leaf=_is_leaf(m),
                output_shape=out_shapes.get(name),
                calls=calls.get(name, 0),
            )
        )
    params = list(model.parameters())
    return ModelSummary(
        model_type=type(model).__name__,
        modules=tuple(rows),
        total_params=sum(p.numel() for p in params),
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        input_shape=input_shape_rec,
        output_shape=output_shape,
        problems=tuple(dict.fromkeys(problems)),  # dedupe, keep order
        forward_error=forward_error,
    )


__all__ = [
    "ModelSummary",
    "ModuleInfo",
    "call_model",
    "example_from_shape",
    "inspect_model",
    "traced_forward",
    "validate_layer_input",
]
