"""What every part of the engine shares: a sequence and its typed parts (each with one writer), request outputs, the
program context a request belongs to."""
