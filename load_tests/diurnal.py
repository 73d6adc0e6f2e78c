"""Diurnal: one compressed day, from a night floor up to the midday peak and back (default 32
users at the peak, 600 s).

    locust -f load_tests/diurnal.py --headless --host http://127.0.0.1:8000 -u 32 --run-time 600s
"""

from pbload.shapes import DiurnalShape
from pbload.users import ChatUser, CompletionUser

__all__ = ["ChatUser", "CompletionUser", "DiurnalShape"]
