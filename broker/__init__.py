"""kvbroker's broker: one rank of a tree of message brokers (see docs/protocol.md).

Importing this package has no side effects: it never touches the event loop
or its policy (the application chooses the loop, see ``broker.loops``).
"""

__version__ = "0.1.0"
