"""Bootstrap: who am I (env discovery), where is everyone (rendezvous store)."""
from .store import FileStore, PrefixStore, Store, TCPStore, TCPStoreServer

__all__ = ["FileStore", "PrefixStore", "Store", "TCPStore", "TCPStoreServer"]
