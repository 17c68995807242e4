"""Imported first by every script: the modules cfp needs, checked before any of them is
imported, so that a script run outside cfp's environment says in one line what is missing and
how to get it instead of ending in an import traceback."""
import importlib.util
import os
import sys

NEEDED = ("numpy", "scipy", "mpi4py", "threadpoolctl", "tqdm", "cfp")


def missing_message(find_spec=importlib.util.find_spec):
    """The line to print when a module cfp needs cannot be imported, or None."""
    missing = [name for name in NEEDED if find_spec(name) is None]
    if not missing:
        return None
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "cfp"
    return (f"{script}: error: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed for "
            f"{sys.executable}; activate cfp's environment first (`. .venv/bin/activate` in the checkout, "
            f"after `make install`) or run the script with .venv/bin/python")


message = missing_message()
if message:
    sys.exit(message)
