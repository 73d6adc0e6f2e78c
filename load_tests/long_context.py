r"""Long context: prompts around 3,000 tokens with short answers (default 8 users, 300 s):
prefill-heavy load, where the KV and prompt-pacing limits bind rather than the batch size.

    locust -f load_tests/long_context.py --headless --host http://127.0.0.1:8000 \
        -u 8 --run-time 300s
"""

from pbload.shapes import LongContextShape
from pbload.users import LongContextUser

__all__ = ["LongContextShape", "LongContextUser"]
