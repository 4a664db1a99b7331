"""Mints Entra-shaped test tokens with PyJWT (an implementation independent of tether-auth), for tether_testkit::idp.

Reads one JSON object from argv[1]: now, tid, other_tid, aud, v2_iss, v1_iss, other_iss.
Prints {"jwks": {kid: public JWK}, "tokens": {case: compact JWS}}: the keys are generated here, so the Rust
side only ever sees public JWKs and finished tokens.
"""

import base64
import hashlib
import hmac
import json
import sys

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def main() -> None:
    p = json.loads(sys.argv[1])
    now = int(p["now"])
    tid, aud = p["tid"], p["aud"]

    k1 = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    k2 = rsa.generate_private_key(public_exponent=65537, key_size=2048)  # published later (rotation)
    e1 = ec.generate_private_key(ec.SECP256R1())

    def public_jwk(key, kid, algorithm):
        jwk = json.loads(algorithm.to_jwk(key.public_key()))
        jwk.update({"kid": kid, "use": "sig", "issuer": p["v2_iss"]})
        return jwk

    jwks = {
        "k1": public_jwk(k1, "k1", RSAAlgorithm),
        "k2": public_jwk(k2, "k2", RSAAlgorithm),
        "e1": public_jwk(e1, "e1", ECAlgorithm),
    }

    def user(iss=p["v2_iss"], **extra):
        claims = {
            "iss": iss,
            "tid": tid,
            "aud": aud,
            "iat": now - 60,
            "nbf": now - 60,
            "exp": now + 3600,
            "oid": "aaaaaaaa-0000-0000-0000-000000000001",
            "sub": "subject-1",
            "preferred_username": "alice@contoso.example",
            "name": "Alice",
            "groups": ["gggggggg-0000-0000-0000-000000000001", "gggggggg-0000-0000-0000-000000000002"],
            "ver": "2.0",
            "scp": "user_impersonation",
            "azp": "04b07795-8ddb-461a-bbee-02f9e1bf7b46",
        }
        claims.update(extra)
        return {k: v for k, v in claims.items() if v is not None}

    def rs(claims, kid="k1", key=k1):
        return jwt.encode(claims, key, algorithm="RS256", headers={"kid": kid, "typ": "JWT"})

    tokens = {}
    tokens["valid_v2"] = rs(user())
    # Names Kubernetes reserves, claimed by a (validly signed) token.
    tokens["system_user"] = rs(user(preferred_username="system:admin"))
    tokens["system_group"] = rs(user(groups=["gggggggg-0000-0000-0000-000000000001", "system:masters"]))
    tokens["system_upn_case"] = rs(user(preferred_username=None, upn="System:kube-controller-manager"))
    tokens["valid_v1"] = rs(
        user(
            iss=p["v1_iss"],
            ver="1.0",
            preferred_username=None,
            upn="bob@contoso.example",
            unique_name="bob@contoso.example",
            oid="aaaaaaaa-0000-0000-0000-000000000002",
            azp=None,
            appid="04b07795-8ddb-461a-bbee-02f9e1bf7b46",
            aud=[aud, "other-audience"],
        )
    )
    tokens["app"] = rs(
        user(
            oid="aaaaaaaa-0000-0000-0000-0000000000a1",
            sub="aaaaaaaa-0000-0000-0000-0000000000a1",
            idtyp="app",
            azp="11111111-2222-3333-4444-555555555555",
            preferred_username=None,
            scp=None,
            groups=None,
            roles=["Tether.Access"],
        )
    )
    tokens["none"] = jwt.encode(user(), None, algorithm="none", headers={"kid": "k1"})
    # HS256 keyed with the RSA public key (the classic confusion attack). PyJWT rightly refuses to build it, so
    # the HMAC is computed by hand.
    pem = k1.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    header = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "k1"}).encode())
    payload = b64(json.dumps(user()).encode())
    mac = hmac.new(pem, f"{header}.{payload}".encode(), hashlib.sha256).digest()
    tokens["hs256_confusion"] = f"{header}.{payload}.{b64(mac)}"
    tokens["wrong_audience"] = rs(user(aud="api://someone-else"))
    tokens["wrong_tenant"] = rs(user(iss=p["other_iss"], tid=p["other_tid"]))
    tokens["tid_mismatch"] = rs(user(tid=p["other_tid"]))
    tokens["expired"] = rs(user(iat=now - 7200, nbf=now - 7200, exp=now - 3600))
    tokens["nbf_future"] = rs(user(nbf=now + 600, exp=now + 4200))
    tokens["unknown_kid"] = rs(user(), kid="k2", key=k2)
    tokens["oversized"] = rs(user(padding="x" * 20000))
    tokens["es256"] = jwt.encode(user(), e1, algorithm="ES256", headers={"kid": "e1"})
    # RS256 header pointing at the EC key: key-type confusion.
    tokens["rs256_with_ec_kid"] = rs(user(), kid="e1")
    tokens["group_overage"] = rs(
        user(
            groups=None,
            _claim_names={"groups": "src1"},
            _claim_sources={"src1": {"endpoint": "https://graph.windows.net/x/users/y/getMemberObjects"}},
        )
    )
    tokens["no_exp"] = rs(user(exp=None))

    print(json.dumps({"jwks": jwks, "tokens": tokens}))


if __name__ == "__main__":
    main()
