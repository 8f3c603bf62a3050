"""Fixtures for the core tests: the fake API server and a client of it, as the kube layer's tests use them."""

from tests.kube.test_kube_layer import kube, server

__all__ = ["kube", "server"]
