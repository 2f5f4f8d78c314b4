"""The five streams of one device as the accelerator sees them (Harmony §4.4).

On CUDA each of compute, swap_in, swap_out, p2p_in and p2p_out is a CUDA stream, and the
program's events become CUDA events: an instruction's stream waits (on the GPU, without
blocking its thread) for the events of the instructions it depends on, so copies and
transfers overlap compute. A tensor made on one stream and used on another is marked with
`record_stream`, so the caching allocator does not hand its memory out again while the other
stream may still read it. On a CPU the stream threads are the streams: every call here does
nothing.
"""

from __future__ import annotations

import contextlib

import torch

from stagewise.ir.instructions import Stream


class DeviceStreams:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.streams = {name: torch.cuda.Stream(device) for name in Stream} if self.cuda else {}
        # instruction index -> its event, made at its first step and recorded again by every later one
        # (an event is waited on only once its instruction is done: recorded this step)
        self.events: dict[int, torch.cuda.Event] = {}

    def begin_step(self) -> None:
        """Every stream starts after what the caller's stream issued (the step's inputs)."""
        if self.cuda:
            caller = torch.cuda.current_stream(self.device)
            for stream in self.streams.values():
                stream.wait_stream(caller)

    def end_step(self) -> None:
        """The step's work is finished on the GPU when `step` returns (its loss, the trained state)."""
        for stream in self.streams.values():
            stream.synchronize()

    def running(self, stream: Stream):
        """Make `stream` the current stream of the calling thread."""
        return torch.cuda.stream(self.streams[stream]) if self.cuda else contextlib.nullcontext()

    def wait(self, stream: Stream, indices: tuple[int, ...]) -> None:
        """`stream` waits for the events of instructions `indices` (their threads recorded them)."""
        if self.cuda:
            for index in indices:
                self.streams[stream].wait_event(self.events[index])

    def record(self, stream: Stream, index: int) -> None:
        """Instruction `index`'s event: set when the work it issued on `stream` is done."""
        if self.cuda:
            event = self.events.get(index)
            if event is None:
                event = self.events[index] = torch.cuda.Event()
            event.record(self.streams[stream])

    def hand_to(self, tensors, stream: Stream) -> None:
        """`tensors`, made on another stream, are used on `stream` from now on."""
        if self.cuda:
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor) and tensor.is_cuda and tensor.numel():
                    tensor.record_stream(self.streams[stream])
