"""Mints Entra-shaped tokens with PyJWT, an implementation independent of the relay's and guard's.

Reads one JSON object from argv[1]: now, iss, tid, aud, oid. Prints {"jwk": public JWK (kid "py1"),
"tokens": {case: compact JWS}}; the private key never leaves this process.
"""

import json
import sys

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm


def main() -> None:
    p = json.loads(sys.argv[1])
    now = int(p["now"])
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(RSAAlgorithm.to_jwk(key.public_key()))
    jwk.update({"kid": "py1", "use": "sig"})

    def claims(**extra):
        c = {
            "iss": p["iss"],
            "tid": p["tid"],
            "aud": p["aud"],
            "iat": now - 60,
            "nbf": now - 60,
            "exp": now + 3600,
            "oid": p["oid"],
            "sub": "py-subject",
            "preferred_username": "carol@contoso.example",
            "groups": [],
            "ver": "2.0",
        }
        c.update(extra)
        return c

    def rs(c):
        return jwt.encode(c, key, algorithm="RS256", headers={"kid": "py1"})

    tokens = {
        "valid": rs(claims()),
        "wrong_audience": rs(claims(aud="api://someone-else")),
        "expired": rs(claims(iat=now - 7200, nbf=now - 7200, exp=now - 3600)),
        "none": jwt.encode(claims(), None, algorithm="none", headers={"kid": "py1"}),
    }
    print(json.dumps({"jwk": jwk, "tokens": tokens}))


if __name__ == "__main__":
    main()
