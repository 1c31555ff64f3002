"""Remote sessions: a shell or a forwarded TCP connection on a device, through the leader and the
broker, with no inbound port on the device (docs/remote.md).

    frames      the wire frames (MQTT between leader and device, length-prefixed on the operator socket)
    flow        the window each direction keeps to
    operator    the CLI's side: the operator socket, the terminal, the forwarded port
"""
