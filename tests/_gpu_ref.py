"""Old name of host_reference.py, for test modules that still import it.
Delete once no test imports ``_gpu_ref``."""
from host_reference import *  # noqa: F401,F403
from host_reference import assert_fa3_tolerance, fa3_bound  # noqa: F401
