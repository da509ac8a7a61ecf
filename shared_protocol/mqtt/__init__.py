"""The MQTT transport: frames as blobs cut into chunks below the broker's packet limit
and put back together safely, over one paho connection.

- :mod:`.config`: :class:`BrokerAddress`, :class:`TransportConfig`, TLS, the chunk size;
- :mod:`.transport`: :class:`MqttTransport`, with its cache of blobs sent for resends in
  :mod:`.resend`;
- :mod:`.chunk_format`, :mod:`.chunked_blob`, :mod:`.reassembly`: the chunk header, a blob
  cut into chunks, inbound chunks put back together (their names gathered in :mod:`.chunking`).

Nothing is imported here: outside code takes the transports from :mod:`shared_protocol.transport`
and the chunks from :mod:`.chunking`.
"""
