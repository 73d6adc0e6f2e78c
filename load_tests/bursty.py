"""Bursty: a quarter of the users, then all of them, alternating (default 24 for 360 s, 30 s
half-periods): the bursts are what push an unmanaged GPU over its ceiling.

    locust -f load_tests/bursty.py --headless --host http://127.0.0.1:8000 -u 24 --run-time 360s
"""

from pbload.shapes import BurstyShape
from pbload.users import ChatUser, CompletionUser

__all__ = ["BurstyShape", "ChatUser", "CompletionUser"]
