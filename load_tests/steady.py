"""Steady: a constant number of chat and completion users (default 16 for 300 s).

locust -f load_tests/steady.py --headless --host http://127.0.0.1:8000 -u 16 --run-time 300s
"""

from pbload.shapes import SteadyShape
from pbload.users import ChatUser, CompletionUser

__all__ = ["ChatUser", "CompletionUser", "SteadyShape"]
