"""``show_source``: how every chapter shows the package's own code.

A chapter builds a component small, then prints the package's version with this helper and
proves the two agree; the package stays the only home of engine code.
"""

from __future__ import annotations

import inspect
from typing import Any


def show_source(*objects: Any) -> None:
    """Render the source of package objects (Triton kernels too) in a notebook as one
    highlighted code block."""
    from IPython.display import Markdown, display

    # A @triton.jit kernel is a wrapper object; its Python function is `.fn`.
    source = "\n".join(
        inspect.getsource(obj.fn if type(obj).__module__.startswith("triton") else obj)
        for obj in objects
    )
    display(Markdown(f"```python\n{source}```"))
