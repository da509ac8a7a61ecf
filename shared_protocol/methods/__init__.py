"""Message types of each method, one module per method, and each method's registry entry.

A method's module registers its message types and its :class:`~shared_protocol.registry.MethodSpec`
on import; :mod:`shared_protocol.registry` imports every module here to find the built-in
methods, so nothing lists them and adding one touches no other method's files.
"""
