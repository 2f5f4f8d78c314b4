"""The generated code of graphs that are gone, dropped from torch.fx's process-wide source cache.

torch.fx compiles each GraphModule's forward from Python source that it keeps, for tracebacks
and `inspect.getsource`, in a cache of its own (`torch.fx.graph_module._loader`, with a lazy
`linecache` entry) that nothing ever empties. A compile generates a dozen graphs (the capture,
its copies at each microbatch size, the stage modules), so a process that compiled again and
again kept about 80 kB of source per compile of a 4-block GPT. `releasing_fx_sources` wraps
`compile` and `load`: when they return (or raise), the source of each graph they generated
that is already gone is dropped, and each that lives on (the stage modules, or any graph still
held) gets a finalizer that drops its source when its class goes. Sources generated outside
such a call (the user's own graphs) are left alone. So are the caches that keep a symbolic export alive
(`_forget_symbolic_caches`).
"""

from __future__ import annotations

import functools
import linecache
import weakref
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.graph_module import _loader

_P = ParamSpec("_P")
_R = TypeVar("_R")
_KEY_PREFIX = "<eval_with_key>."  # fx's keys: "<eval_with_key>.<number>", optionally " from <where>"


def releasing_fx_sources(build: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate a function that generates graphs: the sources of those it leaves behind dead go."""

    @functools.wraps(build)
    def releasing(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        since = _loader.next_id
        cached = set(FakeTensorMode.cache)
        try:
            return build(*args, **kwargs)
        finally:
            release_sources(since)
            _forget_symbolic_caches(cached)

    return releasing


def _forget_symbolic_caches(kept: set) -> None:
    """Two process-wide caches keep a symbolic export's ShapeEnv, with every symbol and guard in it,
    alive (1.3 MB per compile of a 2-block GPT-2): FakeTensorMode's dispatch cache (keyed by the
    symbolic sizes) and ShapeEnv's per-method lru caches (keyed by the env). The dispatches a compile
    added go with it, and the ShapeEnv method caches are emptied (both only save time)."""
    for key in [k for k in FakeTensorMode.cache if k not in kept]:
        FakeTensorMode.cache.pop(key, None)
    for method in vars(ShapeEnv).values():
        if callable(getattr(method, "cache_clear", None)):
            method.cache_clear()


def release_sources(since: int) -> None:
    """Drop the cached source of every graph numbered `since` or later whose forward no live
    GraphModule class holds; the live ones drop theirs when their class is collected."""
    live = _live_forwards()
    for key in list(_loader.eval_cache):
        number = _key_number(key)
        if number is None or number < since:
            continue
        if key in live:
            weakref.finalize(live[key], _forget, key)
        else:
            _forget(key)


def _live_forwards() -> dict[str, type]:
    """Source key -> class, for the forward of every GraphModule class not yet collected (fx makes a
    class per instance, so these are the live graphs; a recompiled graph's older keys are absent)."""
    found: dict[str, type] = {}
    pending: list[type] = [fx.GraphModule]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        code = getattr(cls.__dict__.get("forward"), "__code__", None)
        if code is not None:
            found[code.co_filename] = cls
    return found


def _key_number(key: str) -> int | None:
    if not key.startswith(_KEY_PREFIX):
        return None
    digits = key[len(_KEY_PREFIX):].split(" ", 1)[0]
    return int(digits) if digits.isdigit() else None


def _forget(key: str) -> None:
    _loader.eval_cache.pop(key, None)
    linecache.cache.pop(key, None)
