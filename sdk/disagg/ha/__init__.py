"""High availability: several fabric-manager replicas share one etcd cluster and one of them leads."""

from disagg.ha.election import Leadership

__all__ = ["Leadership"]
