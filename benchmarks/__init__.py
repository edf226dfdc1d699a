"""Speed measurements that are too slow or too machine-dependent for the test suite."""
