"""The engine process: the loop, scheduler, sequences, prefix cache, prompt fitting, outbox."""
