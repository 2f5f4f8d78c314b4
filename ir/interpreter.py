"""One interpreter of device programs, which the simulator and the runtime both subclass.

DESIGN's spine is that the simulator predicts exactly the programs the runtime executes. Both
dispatch through the same table here, `{instruction type: handler}`: a subclass that leaves an
instruction kind out fails when it is defined, and a program holding a type nobody handles raises
a PlanError naming the instruction, so a new kind cannot be executed by one and skipped by the
other. The runtime looks each handler up once per program (`bind`, at compile and `sw.load`), not
once per instruction per step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from stagewise.ir.errors import PlanError
from stagewise.ir.instructions import KINDS, Forward, Instruction, Recompute

Handler = Callable[[Any, int, int, Any], Any]


class Interpreter:
    """Base of the simulator and the executor: `handlers` names, per instruction type, the method
    that runs it; every subclass that sets `handlers` must cover every kind in `KINDS`."""

    handlers: ClassVar[Mapping[type[Instruction], str]] = {}
    _dispatch: ClassVar[dict[type[Instruction], Handler]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "handlers" not in cls.__dict__:
            return
        missing = [kind.__name__ for kind in KINDS if kind not in cls.handlers]
        if missing:
            raise TypeError(f"{cls.__name__} handles no {', '.join(missing)}")
        cls._dispatch = {kind: getattr(cls, name) for kind, name in cls.handlers.items()}

    def dispatch(self, device: int, index: int, ins: Instruction) -> Any:
        """Run instruction `index` of `device`'s program with the handler for its type."""
        return self.handler(device, index, ins)(self, device, index, ins)

    def bind(self, device: int, index: int, ins: Instruction) -> Callable[[], Any]:
        """Instruction `index` of `device`'s program as a call with its handler and arguments resolved,
        made once per program and called every step; an instruction no handler runs is refused here,
        before any step. A subclass may resolve more of what its handler looks up (runtime/handlers.py)."""
        return functools.partial(self.handler(device, index, ins), self, device, index, ins)

    def handler(self, device: int, index: int, ins: Instruction) -> Handler:
        """The handler of `ins`'s type; a PlanError naming the instruction where there is none."""
        handler = self._dispatch.get(type(ins))
        if handler is None:
            raise PlanError(f"{type(self).__name__} cannot run dev{device} #{index} {ins}: "
                            f"no handler for {type(ins).__name__}")
        return handler


def stashes(ins: Instruction) -> bool:
    """Whether the instruction records activations autograd keeps until the microbatch's backward."""
    return isinstance(ins, Recompute) or (isinstance(ins, Forward) and ins.stash)
