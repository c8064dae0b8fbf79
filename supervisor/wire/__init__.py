"""The wire: the HTTP/1.1 sender, TLS, RFC 9421 signing and the classification of answers."""
