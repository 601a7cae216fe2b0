"""Old name of fa3_testing.py, for test modules that still import it (the XLA
flags it used to set are in conftest.py now). Delete once no test imports
``_fa3_testutil``."""
from fa3_testing import ATOL, RTOL, close, nn_attention, rand  # noqa: F401
