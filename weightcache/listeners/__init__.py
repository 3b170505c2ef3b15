"""The listeners the daemon and the swarm's peer server run: the HTTP servers (`http`) and
how each bounds its connections and requests (`admission`)."""
