"""Mints Entra-shaped tokens with PyJWT (a JWT implementation independent of Tether's) for cli/tests/guard.rs.

Reads one JSON object from argv[1]:
  now, iss, other_iss, tid, other_tid, aud, kid, key_file (the development issuer's RSA key, PKCS#8 PEM),
  users: [{name, oid, groups, overage?}]
Prints {"users": {name: token}, "attacks": {case: token}, "service_account": token}.

Valid tokens are signed RS256 with the development issuer's key (so relay, agent and guard find the key in the
issuer's JWKS); attack tokens are built to fail one check each; the service-account token is a JWT whose issuer is
not an Entra authority (it must pass through the relay and the agent untouched).
"""

import base64
import hashlib
import hmac
import json
import sys

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def main() -> None:
    p = json.loads(sys.argv[1])
    now = int(p["now"])
    with open(p["key_file"], "rb") as f:
        key = serialization.load_pem_private_key(f.read(), password=None)

    def claims(user, **extra):
        c = {
            "aud": p["aud"],
            "iss": p["iss"],
            "iat": now - 60,
            "nbf": now - 60,
            "exp": now + 3600,
            "azp": "04b07795-8ddb-461a-bbee-02f9e1bf7b46",
            "name": user["name"],
            "oid": user["oid"],
            "preferred_username": user["name"],
            "scp": "user_impersonation",
            "sub": "pyjwt-" + user["oid"][:8],
            "tid": p["tid"],
            "ver": "2.0",
        }
        if user.get("overage"):
            # Too many groups for the token: Entra leaves them out and points at Graph instead.
            c["_claim_names"] = {"groups": "src1"}
            c["_claim_sources"] = {
                "src1": {"endpoint": f"https://graph.windows.net/{p['tid']}/users/{user['oid']}/getMemberObjects"}
            }
        elif user.get("groups"):
            c["groups"] = user["groups"]
        c.update(extra)
        return {k: v for k, v in c.items() if v is not None}

    def rs(c, kid=p["kid"], signer=key):
        return jwt.encode(c, signer, algorithm="RS256", headers={"kid": kid, "typ": "JWT"})

    users = {u["name"]: rs(claims(u)) for u in p["users"]}
    victim = p["users"][0]
    other = p["users"][-1]

    attacks = {}
    attacks["alg_none"] = jwt.encode(claims(victim), None, algorithm="none", headers={"kid": p["kid"]})
    # HS256 keyed with the issuer's RSA public key (the classic confusion attack), HMAC computed by hand because
    # PyJWT rightly refuses to build it.
    pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    header = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": p["kid"]}).encode())
    payload = b64(json.dumps(claims(victim)).encode())
    mac = hmac.new(pem, f"{header}.{payload}".encode(), hashlib.sha256).digest()
    attacks["hs256_confusion"] = f"{header}.{payload}.{b64(mac)}"
    attacks["wrong_audience"] = rs(claims(victim, aud="api://someone-else"))
    attacks["wrong_tenant"] = rs(claims(victim, iss=p["other_iss"], tid=p["other_tid"]))
    attacks["expired"] = rs(claims(victim, iat=now - 7200, nbf=now - 7200, exp=now - 3600))
    attacks["nbf_future"] = rs(claims(victim, nbf=now + 600, exp=now + 4200))
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    attacks["unknown_kid"] = rs(claims(victim), kid="not-published", signer=stranger)
    # A valid token whose payload is swapped for another user's: the signature no longer matches.
    h, _, s = rs(claims(victim)).split(".")
    forged = json.loads(unb64(rs(claims(victim)).split(".")[1]))
    forged["oid"] = other["oid"]
    forged["groups"] = other.get("groups") or ["tampered"]
    attacks["tampered_payload"] = f"{h}.{b64(json.dumps(forged).encode())}.{s}"
    attacks["oversized"] = rs(claims(victim, padding="x" * 20000))

    service_account = jwt.encode(
        {
            "iss": "https://kubernetes.default.svc.cluster.local",
            "aud": ["https://kubernetes.default.svc.cluster.local"],
            "sub": "system:serviceaccount:dev:ci",
            "iat": now - 60,
            "nbf": now - 60,
            "exp": now + 3600,
            "kubernetes.io": {"namespace": "dev", "serviceaccount": {"name": "ci"}},
        },
        stranger,
        algorithm="RS256",
        headers={"kid": "cluster-sa-key"},
    )

    print(json.dumps({"users": users, "attacks": attacks, "service_account": service_account}))


if __name__ == "__main__":
    main()
