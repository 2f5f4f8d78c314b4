"""Stage modules as Python source files, for people to read.

`stage_source` writes a module with one class whose forward is the stage's generated code
and whose imports are exactly the globals that code uses: a checkpoint's stage_<i>.py, which
`stagewise inspect` shows and plain Python can import. Loading never runs it: a checkpoint
rebuilds its stages from their data (codegen/graph_data.py).
"""

from __future__ import annotations

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
