"""What the web process talks to: the contract, the engine process's client, a remote server."""
