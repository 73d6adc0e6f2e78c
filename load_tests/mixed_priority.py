r"""Mixed priority: interactive (high), standard (normal) and batch (low) users, 3:2:1, in steps
of a quarter, a half, then all of them (default 32 users, 360 s): the load climbs past what the
ceiling allows, so the classes' TTFT and rejection rows should separate.

    locust -f load_tests/mixed_priority.py --headless --host http://127.0.0.1:8000 \
        -u 32 --run-time 360s
"""

from pbload.shapes import MixedPriorityShape
from pbload.users import BatchUser, InteractiveUser, StandardUser

__all__ = ["BatchUser", "InteractiveUser", "MixedPriorityShape", "StandardUser"]
