"""Measured figures for an accelerator of the catalogue, from the one device of it a user has.

Srifty (§4.2) probes a device at four batch sizes instead of trusting its datasheet: achieved
rates are what a plan meets, and datasheet peaks are rarely reached (an H100's 989 TFLOP/s bf16
is dense tensor-core work at ideal shapes). `probe_accelerator` times a square matmul at four
sizes in the plan's precision and keeps the best rate (larger sizes approach the peak the device
reaches), a copy within the device's memory (its bandwidth) and, on a GPU, a pinned host copy
(the swap link); the catalogue entry of that accelerator then carries these figures, each with a
source of kind `measured`, and `sw.plan` / `sw.recommend` over the returned catalogue use them
(the recommendation table says which accelerators' figures are measured). Given the model being
planned (`model=`, `example_inputs=`), the FLOP/s figure is instead that model's achieved rate,
fitted from forward + backward at four microbatch sizes (compiler/advice/probe_model.py): closer to
what a plan for that model meets than any matmul's.
"""

from __future__ import annotations

import datetime
import functools
import platform
from dataclasses import replace

import torch

from stagewise.catalogue.entries import Catalogue, Dtype, Figure, Source, SourceKind
from stagewise.catalogue.files import shipped_catalogue
from stagewise.compiler.advice.probe_model import probe_model, tf32_only_for
from stagewise.compiler.compile.calibrate import COPY_BYTES, best_seconds
from stagewise.ir.devices import check_present, resolve_devices
from stagewise.ir.errors import DeviceError, OptionError

PROBE_SIZES = (512, 1024, 2048, 4096)  # square matmul sizes: Srifty's four probes
TORCH_DTYPES = {Dtype.FP32: torch.float32, Dtype.TF32: torch.float32, Dtype.BF16: torch.bfloat16,
                Dtype.FP16: torch.float16}


def probe_accelerator(name: str, device: str = "cuda:0", catalogue: Catalogue | None = None,
                      precision: Dtype | str = Dtype.FP32, *, model: torch.nn.Module | None = None,
                      example_inputs=None, loss_fn=None, example_target=None) -> Catalogue:
    """`catalogue` (the shipped one by default) with accelerator `name`'s peak FLOP/s for `precision`,
    memory bandwidth and host link replaced by rates measured on `device` (which must be one).

    Without `model` the FLOP/s is a square matmul's best; with it (and `example_inputs`, plus
    `loss_fn` / `example_target` as `sw.plan` takes them) it is that model's achieved rate,
    fitted from forward + backward of a copy on `device` at microbatches B/8, B/4, B/2, B. Pass the
    result as `sw.recommend(catalogue=)` or `sw.parse_device_request(catalogue=)` to plan with measured
    figures.

    Args:
        name: the catalogue accelerator the device is ('L4', 'H100', 'CPU').
        device: the device to measure, one of this machine's.
        catalogue: the catalogue to update; None for the shipped one.
        precision: which peak FLOP/s to measure: 'fp32', 'tf32', 'bf16' or 'fp16'.
        model: a model to time instead of a matmul (it may sit on the CPU; a copy is timed).
        example_inputs: the model's minibatch, with `model`.
        loss_fn: as `sw.plan` takes it, with `model`.
        example_target: as `sw.plan` takes it, with `model`.

    Returns:
        A copy of the catalogue with the accelerator's figures measured (their source says so).

    Raises:
        DeviceError: an unknown accelerator, a device that is absent or of another kind.
        OptionError: model arguments given without `model`, or `model` without `example_inputs`.
        ProfileError: a model with no FLOPs torch's counter counts.

    Example:
        >>> measured = sw.probe_accelerator("CPU", "cpu")
        >>> measured.accelerator("CPU").peak_flops.fp32.note
        'best of 4 matmul sizes'
    """
    catalogue = catalogue if catalogue is not None else shipped_catalogue()
    dtype = Dtype(precision)
    accelerator = catalogue.accelerator(name)
    _check_model_arguments(model, example_inputs, loss_fn, example_target)
    where = resolve_devices([device])
    check_present(where)
    torch_device = where[0].torch_device
    if torch_device.type != accelerator.kind.value:
        raise DeviceError(f"{accelerator.name} is a {accelerator.kind.value} accelerator but {device!r} is a "
                          f"{torch_device.type} device; probe it on a device of its kind")
    source = _measured_source(torch_device)
    if model is not None:
        fit = probe_model(model, example_inputs, torch_device, dtype, loss_fn=loss_fn, example_target=example_target)
        flops = Figure(fit.rate, (source,), note=fit.note)
    else:
        flops = Figure(_matmul_flops(torch_device, dtype), (source,), note=f"best of {len(PROBE_SIZES)} matmul sizes")
    copy = Figure(_copy_bandwidth(torch_device), (source,), note="device-to-device copy, counted once")
    host = Figure(_host_bandwidth(torch_device), (source,), note="pinned host copy, slower direction") \
        if torch_device.type == "cuda" else accelerator.host_bandwidth
    measured = replace(accelerator, peak_flops=replace(accelerator.peak_flops, **{dtype.value: flops}),
                       memory_bandwidth=copy, host_bandwidth=host)
    others = tuple(a for a in catalogue.accelerators if a.name != accelerator.name)
    return Catalogue(others + (measured,), catalogue.instance_types)


def _check_model_arguments(model: object, example_inputs: object, loss_fn: object, example_target: object) -> None:
    """The model probe needs a model and its example together; loss arguments belong to a model."""
    if model is not None and example_inputs is None:
        raise OptionError("probe_accelerator(model=...) needs example_inputs= too (a tuple or dict of tensors, as "
                          "sw.plan takes them): the model is timed on slices of that batch")
    if model is None and any(v is not None for v in (example_inputs, loss_fn, example_target)):
        raise OptionError("example_inputs=, loss_fn= and example_target= describe the model to probe; pass model= "
                          "as well, or none of them for the matmul probe")


def _measured_source(device: torch.device) -> Source:
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    return Source(url=f"stagewise-probe://{device}", title=f"measured on {what} ({device}) by sw.probe_accelerator",
                  accessed=datetime.date.today(), kind=SourceKind.MEASURED)


def _matmul_flops(device: torch.device, dtype: Dtype) -> float:
    """The best FLOP/s of an n x n matmul over the probe sizes (TF32 allowed only when asked for)."""
    with tf32_only_for(dtype):
        rates = []
        for n in PROBE_SIZES if device.type == "cuda" else PROBE_SIZES[:2]:  # a CPU: seconds per 4096^3
            a = torch.randn(n, n, device=device, dtype=TORCH_DTYPES[dtype])
            b = torch.randn(n, n, device=device, dtype=TORCH_DTYPES[dtype])
            rates.append(2 * n**3 / best_seconds(functools.partial(torch.mm, a, b), device, repeats=3))
        return max(rates)


def _copy_bandwidth(device: torch.device) -> float:
    size = COPY_BYTES * (16 if device.type == "cuda" else 1)
    src = torch.empty(size // 4, device=device)
    dst = torch.empty_like(src)
    return size / best_seconds(lambda: dst.copy_(src), device)


def _host_bandwidth(device: torch.device) -> float:
    src = torch.empty(COPY_BYTES // 4, device=device)
    host = torch.empty(COPY_BYTES // 4, pin_memory=True)
    slower = max(best_seconds(lambda: src.copy_(host, non_blocking=True), device),
                 best_seconds(lambda: host.copy_(src, non_blocking=True), device))
    return COPY_BYTES / slower
