"""The node daemon (design §5-§8) and its parts: the fetch socket (coord), the listeners
(serve), peers, metrics, node labels, the models file, the supervised loops (worker)."""
