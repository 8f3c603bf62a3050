"""Guards for the listeners reachable from the pod network, shared by the extender and the agent: the accept loop
that counts every connection from its accept, with fair room across client addresses and paced TLS handshakes
(`acceptgate`). It imports nothing of gputopo's."""
