"""Shared parts of the locust profiles in load_tests/.

Only `users` and `shapes` import locust (which monkey-patches the process with gevent); the rest
is plain Python so the test suite can import and check it in-process.
"""
