"""The stress tests start real local clusters with the integration tests' fixtures."""

from tests.integration.conftest import (
    home,
    make_cluster_from_spec,
    pytest_runtest_makereport,
)

__all__ = ["home", "make_cluster_from_spec", "pytest_runtest_makereport"]
