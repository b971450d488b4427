"""The CPU kernels' Python side: their build (build), ctypes bindings (ops), the thread governor (threads), malloc
tuning (memory)."""
