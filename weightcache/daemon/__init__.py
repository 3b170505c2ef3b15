"""The node daemon (design §5-§7): its roles (the converger, the capacity guard, the
coordinator of the Pods' fetches, the lease reaper), the fetch socket's protocol
(fetchsocket), the models file, metrics and node labels. Its peers are weightcache/swarm/."""
