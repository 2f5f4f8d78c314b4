"""What the executor looks up on every instruction, computed once per program instead of per step.

A tiny model pays the runtime's own cost on every instruction (issue 9: at most 50 us above
eager training), so nothing on that path formats, builds or searches what a program already
fixes: each stream's instructions, the monitor keys an instruction waits on and publishes, its
name in errors, the transport keys of the messages a send or receive moves, and each instruction
as the call that runs it, its handler and arguments resolved (`lower`: at compile and `sw.load`,
and whenever the programs are replaced, never per step).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from stagewise.ir.instructions import Instruction, MessageKey, Recv, Send, Stream, message_keys
from stagewise.ir.program import Program


class ProgramTables:
    """One device program's lookups: `order[stream]` its instructions on that stream; per index `i`,
    `stream[i]` its stream, `sends_to[i]` a send's receiving device (None for other kinds),
    `labels[i]` (errors), `waits_on[i]` and `done_key[i]` (the `Sync` keys of its events and its own
    completion), for sends and receives `messages[i]`: (value, transport key) per message, and for
    receives `incoming[i]`: the transport keys alone (a send's is empty); once lowered, `calls[i]`
    runs instruction `i`."""

    def __init__(self, program: Program):
        device, code = program.device, program.instructions
        self.labels = [f"dev{device} #{i} {ins}" for i, ins in enumerate(code)]
        self.stream = [ins.stream for ins in code]  # each instruction's (a property of its kind)
        self.sends_to = [ins.peer if isinstance(ins, Send) else None for ins in code]  # a send's receiving device
        self.order = {stream: [i for i, ins in enumerate(code) if ins.stream is stream] for stream in Stream}
        self.streams = [stream for stream in Stream if self.order[stream]]
        self.done_key: list[Hashable] = [("done", device, i) for i in range(len(code))]
        self.waits_on = [tuple(self.done_key[j] for j in ins.waits) for ins in code]
        self.messages = [tuple((key.value, transport_key(key)) for key in message_keys(ins))
                         if isinstance(ins, (Send, Recv)) else () for ins in code]
        self.incoming = [tuple(key for _, key in self.messages[i]) if isinstance(ins, Recv) else ()
                         for i, ins in enumerate(code)]
        self.calls: list[Callable[[], object]] = []

    def lower(self, program: Program, bind: Callable[[int, int, Instruction], Callable[[], object]]) -> None:
        """Each instruction as a prebound call (`Interpreter.bind`): a step calls `calls[i]()`, with no
        type dispatch, lookup or key building of its own. After every program's tables exist, since a
        binder reads them."""
        self.calls = [bind(program.device, index, ins) for index, ins in enumerate(program.instructions)]


def transport_key(key: MessageKey) -> tuple:
    """The transport's key of a message (hashable, and a gloo tag's source under torch.distributed)."""
    return (key.carries.value, key.value, key.microbatch, key.src_stage, key.dst_stage)
