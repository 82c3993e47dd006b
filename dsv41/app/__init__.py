"""The `dsv41` command, the notebook runner and `dsv41 lab`."""
