"""Step 2 of a call, check support: the version gate (`upstream/gate.py`), asked with what the call path knows.

`check_upstream(model_class=..., *, generate)` is `gate.check_upstream` given the hook targets the call path declares
(`hooks.hook_targets`: the targets of `hooks.HOOKS`, the one table of hooks) and the verdicts `state.PROCESS` keeps. It
is a `functools.partial`, not a function of its own, so a bucketed call enters no module for it
(`tests/generation/test_call_modules.py` counts them).
"""

import functools

from ..state import PROCESS
from ..upstream import gate
from . import hooks


check_upstream = functools.partial(gate.check_upstream, hook_targets=hooks.hook_targets, verdicts=PROCESS)
