"""``show_source``: how every chapter shows the package's own code.

A chapter builds a component small, then prints the package's version with this helper and
proves the two agree; the package stays the only home of engine code. The answer key never
ships (chapters/INSTRUCTORS.md): an assignment region is shown as its stub alone,
``raise NotImplementedError("assignment ID: ...")`` under the handout docstring, without the
region's marker lines.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from nanovllm.course.regions import regions_in_file


def elided_source(obj: Any) -> str:
    """The source of ``obj`` (a function, class, module or Triton kernel) with the code of
    every assignment region inside it replaced by the region's stub."""
    # A @triton.jit kernel is a wrapper object; its Python function is `.fn`.
    obj = obj.fn if type(obj).__module__.startswith("triton") else obj
    lines, first = inspect.getsourcelines(obj)
    first = max(first, 1)  # a module starts at "line 0"
    path = inspect.getsourcefile(obj)
    regions = regions_in_file(Path(path)) if path else []
    for region in sorted(regions, key=lambda r: r.start, reverse=True):
        if first <= region.start and region.end < first + len(lines):
            lines[region.start - first : region.end - first + 1] = [region.stub()]
    return "".join(lines)


def show_source(*objects: Any) -> None:
    """Render the source of package objects (Triton kernels too) in a notebook as one
    highlighted code block, assignment regions elided (:func:`elided_source`)."""
    from IPython.display import Markdown, display

    source = "\n".join(elided_source(obj) for obj in objects)
    display(Markdown(f"```python\n{source}```"))
