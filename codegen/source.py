"""Stage modules as importable Python source files, and back.

`stage_source` writes a module with one class whose forward is the stage's generated code
and whose imports are exactly the globals that code uses. `load_stage` imports such a file,
attaches the saved submodules and tensors under their FQNs and re-traces it into a
GraphModule: the saved file, not the original model class, defines what runs.
"""

from __future__ import annotations

import importlib.util
import textwrap
import types

import torch
import torch.fx as fx

from stagewise.ir.errors import PlanError

_BUILTIN_NAMES = {"inf": "from math import inf", "nan": "from math import nan", "NoneType": "NoneType = type(None)"}


def stage_source(module: fx.GraphModule, docstring: str) -> str:
    code = module.graph.python_code(root_module="self")
    imports = {"import torch"}
    for name, obj in code.globals.items():
        imports.add(_import_line(name, obj))
    body = textwrap.indent(code.src.strip("\n"), "    ")
    header = f'"""{docstring}"""\n\n' + "\n".join(sorted(i for i in imports if i)) + "\n\n\n"
    return header + f"class {type(module).__name__}(torch.nn.Module):\n{body}\n"


def _import_line(name: str, obj) -> str:
    if name in _BUILTIN_NAMES:
        return _BUILTIN_NAMES[name]
    if isinstance(obj, types.ModuleType):
        return f"import {obj.__name__}" if obj.__name__ == name else f"import {obj.__name__} as {name}"
    if name == "device" and obj is torch.device:
        return "from torch import device"
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or "<" in qualname or "." in qualname:
        raise PlanError(
            f"the stage code calls {obj!r}, which cannot be imported by name; "
            "use a module-level function (not a lambda or closure) as loss_fn to save the pipeline"
        )
    return f"from {module} import {qualname} as {name}" if qualname != name else f"from {module} import {name}"


def load_stage(path: str, class_name: str, attrs: dict[str, object]) -> fx.GraphModule:
    spec = importlib.util.spec_from_file_location(f"stagewise_saved_{class_name.lower()}_{id(attrs)}", path)
    if spec is None or spec.loader is None:
        raise PlanError(f"cannot import stage source {path}")
    source = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(source)
    instance = getattr(source, class_name)()
    for target, value in attrs.items():
        _assign(instance, target, value)
    tracer = fx.Tracer()
    tracer.proxy_buffer_attributes = True  # buffers stay get_attr of their FQN, not anonymous constants
    graph = tracer.trace(instance)
    return fx.GraphModule(instance, graph, class_name=class_name)


def _assign(root: torch.nn.Module, target: str, value) -> None:
    *path, leaf = target.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    if isinstance(value, torch.nn.Module):
        module.add_module(leaf, value)
    elif isinstance(value, torch.nn.Parameter):
        module.register_parameter(leaf, value)
    else:
        module.register_buffer(leaf, value)
